"""Model -> smaller model transforms, the serving artifact, and the quantization CLI."""
