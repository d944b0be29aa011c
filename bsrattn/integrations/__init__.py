"""Adapters that run other libraries' models on bsrattn's attention.

Each module imports the library it adapts, and only it does: ``import bsrattn`` and ``import
bsrattn.integrations`` import none of them.
"""
