"""What users run around the engine: tune, bench, calc, calibrate, train, search, and the reference decoders."""
