"""edgekv"""
