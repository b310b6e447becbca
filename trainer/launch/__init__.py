"""Launching: which launcher a config needs (for launch.sh), the torchrun / deepspeed / single / torchft wrappers
with Tessera's exits, automatic restarts, and DeepSpeed's op builds."""
