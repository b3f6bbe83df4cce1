"""recipes.upcycle: upcycle: a teacher becomes a student with a smaller KV cache (surgery, blockwise, global, verify, benchmark)."""
