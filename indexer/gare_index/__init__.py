"""The index format, the contract between the builder and the search: versioned stores, ANN types, psi
constants, the metadata database and what a manifest says about itself."""
