"""The cluster calculator (``shardwise plan llama3-8b --gpu h100 --gpus 64 ...``): calc.py."""
