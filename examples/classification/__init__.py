"""Large-scale classification with Whale: a replicated ResNet-style backbone and a split (class-sharded) head."""
