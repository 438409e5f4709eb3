"""Kernel implementations behind the custom ops; the torch reference is always present."""
