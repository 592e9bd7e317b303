"""Benchmarks: ``hf-specdec bench`` (Spec-Bench speedups over vanilla generate(), `spec_bench`), its question
sampling (`questions`), the compared methods (`methods`) and the report writers (`report`)."""
