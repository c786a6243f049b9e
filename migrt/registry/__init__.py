"""Checkpoints as OCI images in a registry: push, pull (verified before commit), restore by reference."""
