"""The stages of the build/add pipeline behind `gare-index` (the commands are in ``gare_build.build``):
``plan`` -> ``encode`` -> ``assemble`` -> ``finish``, with ``biases`` (NCL video biases), ``invgc`` (InvGC setup
and vectors), ``options`` (build options, the run report) and ``stats`` (`gare-index stats`)."""
