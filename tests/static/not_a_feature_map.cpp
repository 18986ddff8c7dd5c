// Must NOT compile: ctest checks that the error carries our readable message.
#include <linattn/attention.hpp>

struct NotAFeatureMap {};

int main() {
  linattn::LinearAttention<NotAFeatureMap> attn;
  (void)attn;
}
