"""The processes of ``gare-serve --workers N``: the port group and per-worker sockets (``port_group``), how long
the supervisor and its workers live (``worker_lifetime``), and the uvicorn config pickled into every worker
(``uvicorn_config``)."""
