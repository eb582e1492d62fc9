"""mok inside other frameworks. Each integration is a module imported on its own (importing mok
imports none of them, nor the framework they need):

    mok.integrations.transformers   experts_implementation="mok" for Hugging Face Transformers
"""
