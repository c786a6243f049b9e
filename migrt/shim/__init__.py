"""migrt-runc: the runtime entry point. Standard library only until the decision is made."""
