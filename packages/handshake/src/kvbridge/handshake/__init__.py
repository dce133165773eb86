"""kvbridge side-channel handshake: wire messages, server and client."""
