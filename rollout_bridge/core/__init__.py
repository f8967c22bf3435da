"""Engine-independent parts of the bridge: types, the engine contract, shared decoding, packing."""
