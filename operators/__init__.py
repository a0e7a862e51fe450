"""trims.operators"""
