"""recipes.distill: knowledge distillation: the recipe, the offline teacher cache, the teacher."""
