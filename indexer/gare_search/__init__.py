"""The query-time search over one index version: encode -> stage 1 -> psi rerank -> biases -> rank, by text,
by example and by image."""
