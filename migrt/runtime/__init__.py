"""The lower runtime (runc, crun, nvidia-container-runtime)."""
