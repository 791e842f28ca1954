"""LoRA adapters served next to the base model: which adapter a request uses (request.py), what an adapter
holds (adapter_config.py, weights.py), and the batched product that adds every adapter's delta in one step
(layers.py)."""
