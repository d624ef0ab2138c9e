"""The sparse payload's code words, shared by the coder (coding.py) and its numba kernels
(_kernels.py), which coding.py imports only on first use."""

SHORT_GAP = 256  # gaps 1..255 fit a byte; 0 marks a long one
CODE_PLUS, CODE_MINUS, CODE_SMALL, CODE_LARGE = 0, 1, 2, 3
