"""The stages of the build/add pipeline behind `gare-index` (the commands are in ``gare_build.build``):
``plan`` (with the post-processing decision) -> ``encode`` -> ``assemble`` -> ``finish``, with ``biases`` (NCL
video biases), ``options`` (build options, the run report) and ``stats`` (`gare-index stats`)."""
