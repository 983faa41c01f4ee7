"""The Ray Serve deployment of a sharded index: the application and its deployments (``deployment``), a shard
replica (``shard_replica``) and the ingress's state that fans searches out to the shards (``ingress_state``); a Ray
node started with every listener on one address (``ray_node``) and gare-serve's HTTP limits in Serve's own proxy
(``proxy_limits``, which loads ``proxy_chain``)."""
