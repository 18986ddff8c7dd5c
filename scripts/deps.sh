# Sourced by the scripts: make sure Debian packages are installed, installing them when we are
# root, otherwise printing the exact command to run.
ensure_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    echo "linattn: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    echo "linattn: missing packages; run:  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
}
