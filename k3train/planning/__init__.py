"""Planning before renting the cluster: memory per pipeline stage and rank (:mod:`k3train.planning.memory`),
estimated by running the real stage code on fake tensors, and measured on real training steps
(:mod:`k3train.planning.measure`); both count live tensor bytes with :class:`~k3train.planning.live_bytes.LiveBytes`."""
