"""The wire format of DumbDiLoCo: safetensors files, delta encodings and where files live in a repository."""
