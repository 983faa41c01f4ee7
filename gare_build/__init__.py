"""The index builder (`gare-index`): discover, decode, encode and write index versions; tune stage 1; fit NCL
biases and InvGC; compare configurations."""
