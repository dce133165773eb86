"""kvbridge KV-cache memory regions and NIXL descriptor geometry."""
