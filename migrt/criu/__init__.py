"""CRIU: options model, versions and checks, errors quoted from its logs, image inspection."""
