"""The DeepSeek group: DeepSeek V3 / V2 (`v3/`, deepseek_v3: latent attention, DeepSeek MoE, multi-token
prediction). Later DeepSeek families join it beside V3, sharing what they share through modules of this folder."""
