"""The coordinator: its TCP server, its wire protocol and its client."""
