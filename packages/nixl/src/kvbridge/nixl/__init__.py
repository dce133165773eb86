"""kvbridge transfer engine on NVIDIA NIXL, kvbridge demo and bench."""
