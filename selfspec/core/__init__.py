"""The engine: the decode loop, the batch scheduler, the verifier, sampling and the statistics every generation reports."""
