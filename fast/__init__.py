"""The fast torch implementation of the Gemma 4 stack (CPU and CUDA). Built in a later issue; see README."""

if __name__ != "gemma4_harness.fast":  # imported by its folder name, a checkout on sys.path: no second copy
    from gemma4_harness import _refuse_folder_name

    _refuse_folder_name(__name__)
