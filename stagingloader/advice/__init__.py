"""Advice before a job: ``probe`` measures a tier or a source, ``plan`` says whether storage keeps the GPUs fed."""
