"""The node's duties beside serving: the node agent (gossip, energy), in-cluster config sync, the
fleet quota claims, and getting a model onto the node (fetch, tiny model, engine install)."""
