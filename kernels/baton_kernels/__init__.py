"""Triton kernels for the GPU attention path, each with a pure-torch reference.

The kernels arrive with the Triton issue; the package exists so that the distribution's
three source roots (services/, kernels/, loadtest/) are in place from the start.
"""
