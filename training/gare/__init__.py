"""GARE core library: the model (open_clip backbone, temporal transformer, psi), the fold and its CPU kernel,
checkpoints, video decoding, Sinkhorn (NCL), text towers, annotations and metrics.

The builder (gare_build), the search (gare_search), the service (gare_serve) and the trainer (gare_train)
import it; it imports none of them."""

__version__ = "0.1.0"
