"""dreamstage: one resident GGUF model that serves and keeps learning.

Importing the package is cheap; the native library loads on first use through
``dreamstage.native``.
"""
__version__ = "0.1.0"
