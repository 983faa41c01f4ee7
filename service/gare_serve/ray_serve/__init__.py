"""The Ray Serve deployment of a sharded index: the application and its deployments (``deployment``), a shard
replica (``shard_replica``) and the ingress's state that fans searches out to the shards (``ingress_state``)."""
