"""The constants of the context-sorted delta's key (docs/format.md, section 4), shared by the
numpy code in context.py and the compiled kernels in context_kernels.py."""

WIDTHS = (2, 4, 8)  # element widths the context is defined for: the top byte holds the exponent
HIGHER_CAP = 3  # residual byte above, capped: 0, 1, 2 or "3 and more" (4 contexts per top byte)
KEYS = 256 * (HIGHER_CAP + 1)
