"""trims.daemon"""
