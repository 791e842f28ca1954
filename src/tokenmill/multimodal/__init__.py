"""Inputs other than text: images, read from the URLs a request gives and checked before a model sees them."""
