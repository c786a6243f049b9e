"""Node-to-node migration: `migrt migrate` (sender), `migrt receive` (receiver) and the wire between them."""
