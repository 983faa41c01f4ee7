"""The Ray Serve deployment of a sharded index: the application, a shard replica, the ingress state."""
