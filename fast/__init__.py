"""The fast torch implementation of the Gemma 4 stack (CPU and CUDA). Built in a later issue; see README."""
