"""linattn's Python packages. ``linattn.torch``: fla-compatible linear-attention ops on CPU."""
