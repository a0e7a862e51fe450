"""trims.kernels"""
