"""Mixture of experts for Megatron-Core: router (router.py) and its balancers (balancers.py), all-to-all dispatcher
(dispatcher.py), grouped experts (experts.py), the layer and its spec (layer.py), and the
quantile-balancing routing math (quantile*.py). See docs/moe.md. Import submodules directly;
this package imports nothing so that the pure routing math stays cheap to import.
"""
