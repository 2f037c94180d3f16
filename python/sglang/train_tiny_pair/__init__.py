"""``python -m sglang.train_tiny_pair``: train the embedded target, distill
its DSpark draft, write both checkpoint directories (see ``train.py``)."""
