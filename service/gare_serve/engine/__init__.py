"""The search engine the routes call: what the service holds while it runs (``state``: model, query encoder, served
version), the checks before loading, the served version's lifetime, reloads and following CURRENT, the request
options decided from the manifest and the searches a request runs, the micro-batcher and its worker, the query and
result caches, the query bank, the stage-1 recall watch, the Prometheus metrics and the board several workers
share."""
