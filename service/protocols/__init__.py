"""The protocols' codecs: bytes <-> tensors and back, and each protocol's own error body. They know
the core only, no web framework."""
