"""The node CLI (click). One module per command group; rendering in render.py."""
